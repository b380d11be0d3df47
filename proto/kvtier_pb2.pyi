from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SlotStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SLOT_STATUS_UNSPECIFIED: _ClassVar[SlotStatus]
    ALREADY_STORED: _ClassVar[SlotStatus]
    NO_SPACE: _ClassVar[SlotStatus]
SLOT_STATUS_UNSPECIFIED: SlotStatus
ALREADY_STORED: SlotStatus
NO_SPACE: SlotStatus

class OpenRequest(_message.Message):
    __slots__ = ("client_name", "layout_signature", "block_bytes", "block_tokens", "protocol_version", "client_pid", "client_pid_ns", "engine_group", "lost_sessions", "layout_description")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLIENT_PID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_PID_NS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_GROUP_FIELD_NUMBER: _ClassVar[int]
    LOST_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    layout_signature: bytes
    block_bytes: int
    block_tokens: int
    protocol_version: int
    client_pid: int
    client_pid_ns: int
    engine_group: str
    lost_sessions: _containers.RepeatedScalarFieldContainer[str]
    layout_description: str
    def __init__(self, client_name: _Optional[str] = ..., layout_signature: _Optional[bytes] = ..., block_bytes: _Optional[int] = ..., block_tokens: _Optional[int] = ..., protocol_version: _Optional[int] = ..., client_pid: _Optional[int] = ..., client_pid_ns: _Optional[int] = ..., engine_group: _Optional[str] = ..., lost_sessions: _Optional[_Iterable[str]] = ..., layout_description: _Optional[str] = ...) -> None: ...

class OpenResponse(_message.Message):
    __slots__ = ("session_id", "daemon_id", "arena_path", "arena_bytes", "num_slots", "slot_bytes", "lease_ms", "max_hashes", "max_reserved", "max_acquired", "lookup_hold_ms", "slot_lookups", "reserve_ahead")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DAEMON_ID_FIELD_NUMBER: _ClassVar[int]
    ARENA_PATH_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_HASHES_FIELD_NUMBER: _ClassVar[int]
    MAX_RESERVED_FIELD_NUMBER: _ClassVar[int]
    MAX_ACQUIRED_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HOLD_MS_FIELD_NUMBER: _ClassVar[int]
    SLOT_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    RESERVE_AHEAD_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    daemon_id: str
    arena_path: str
    arena_bytes: int
    num_slots: int
    slot_bytes: int
    lease_ms: int
    max_hashes: int
    max_reserved: int
    max_acquired: int
    lookup_hold_ms: int
    slot_lookups: bool
    reserve_ahead: int
    def __init__(self, session_id: _Optional[str] = ..., daemon_id: _Optional[str] = ..., arena_path: _Optional[str] = ..., arena_bytes: _Optional[int] = ..., num_slots: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., lease_ms: _Optional[int] = ..., max_hashes: _Optional[int] = ..., max_reserved: _Optional[int] = ..., max_acquired: _Optional[int] = ..., lookup_hold_ms: _Optional[int] = ..., slot_lookups: _Optional[bool] = ..., reserve_ahead: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ("aborted", "released")
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    aborted: int
    released: int
    def __init__(self, aborted: _Optional[int] = ..., released: _Optional[int] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("lease_ms",)
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    lease_ms: int
    def __init__(self, lease_ms: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("session_id", "hashes", "probed_host")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    PROBED_HOST_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    hashes: bytes
    probed_host: int
    def __init__(self, session_id: _Optional[str] = ..., hashes: _Optional[bytes] = ..., probed_host: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("host", "disk", "remote")
    HOST_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    host: int
    disk: int
    remote: int
    def __init__(self, host: _Optional[int] = ..., disk: _Optional[int] = ..., remote: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("session_id", "hashes", "metas", "call_id", "unnamed")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    METAS_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    UNNAMED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    hashes: bytes
    metas: _containers.RepeatedScalarFieldContainer[bytes]
    call_id: int
    unnamed: int
    def __init__(self, session_id: _Optional[str] = ..., hashes: _Optional[bytes] = ..., metas: _Optional[_Iterable[bytes]] = ..., call_id: _Optional[int] = ..., unnamed: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("slots",)
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, slots: _Optional[_Iterable[int]] = ...) -> None: ...

class SlotsRequest(_message.Message):
    __slots__ = ("session_id", "slots", "hashes", "metas")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    METAS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    slots: _containers.RepeatedScalarFieldContainer[int]
    hashes: bytes
    metas: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, session_id: _Optional[str] = ..., slots: _Optional[_Iterable[int]] = ..., hashes: _Optional[bytes] = ..., metas: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SlotsResponse(_message.Message):
    __slots__ = ("count", "not_stored")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    NOT_STORED_FIELD_NUMBER: _ClassVar[int]
    count: int
    not_stored: int
    def __init__(self, count: _Optional[int] = ..., not_stored: _Optional[int] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("session_id", "hashes", "call_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    hashes: bytes
    call_id: int
    def __init__(self, session_id: _Optional[str] = ..., hashes: _Optional[bytes] = ..., call_id: _Optional[int] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("slots", "host", "disk", "remote")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    host: int
    disk: int
    remote: int
    def __init__(self, slots: _Optional[_Iterable[int]] = ..., host: _Optional[int] = ..., disk: _Optional[int] = ..., remote: _Optional[int] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("session_id", "call_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    call_id: int
    def __init__(self, session_id: _Optional[str] = ..., call_id: _Optional[int] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("returned",)
    RETURNED_FIELD_NUMBER: _ClassVar[int]
    returned: int
    def __init__(self, returned: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("session_id", "hashes", "seconds")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    hashes: bytes
    seconds: float
    def __init__(self, session_id: _Optional[str] = ..., hashes: _Optional[bytes] = ..., seconds: _Optional[float] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("pinned", "refused")
    PINNED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    pinned: int
    refused: int
    def __init__(self, pinned: _Optional[int] = ..., refused: _Optional[int] = ...) -> None: ...

class SlotOp(_message.Message):
    __slots__ = ("op_id", "reserve", "commit", "abort", "acquire", "release", "cancel", "lookup")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    op_id: int
    reserve: ReserveRequest
    commit: SlotsRequest
    abort: SlotsRequest
    acquire: AcquireRequest
    release: SlotsRequest
    cancel: CancelRequest
    lookup: LookupRequest
    def __init__(self, op_id: _Optional[int] = ..., reserve: _Optional[_Union[ReserveRequest, _Mapping]] = ..., commit: _Optional[_Union[SlotsRequest, _Mapping]] = ..., abort: _Optional[_Union[SlotsRequest, _Mapping]] = ..., acquire: _Optional[_Union[AcquireRequest, _Mapping]] = ..., release: _Optional[_Union[SlotsRequest, _Mapping]] = ..., cancel: _Optional[_Union[CancelRequest, _Mapping]] = ..., lookup: _Optional[_Union[LookupRequest, _Mapping]] = ...) -> None: ...

class SlotOpBatch(_message.Message):
    __slots__ = ("session_id", "ops")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    ops: _containers.RepeatedCompositeFieldContainer[SlotOp]
    def __init__(self, session_id: _Optional[str] = ..., ops: _Optional[_Iterable[_Union[SlotOp, _Mapping]]] = ...) -> None: ...

class SlotResult(_message.Message):
    __slots__ = ("op_id", "code", "message", "reserve", "slots", "acquire", "cancel", "lookup")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    op_id: int
    code: int
    message: str
    reserve: ReserveResponse
    slots: SlotsResponse
    acquire: AcquireResponse
    cancel: CancelResponse
    lookup: LookupResponse
    def __init__(self, op_id: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., reserve: _Optional[_Union[ReserveResponse, _Mapping]] = ..., slots: _Optional[_Union[SlotsResponse, _Mapping]] = ..., acquire: _Optional[_Union[AcquireResponse, _Mapping]] = ..., cancel: _Optional[_Union[CancelResponse, _Mapping]] = ..., lookup: _Optional[_Union[LookupResponse, _Mapping]] = ...) -> None: ...

class SlotResultBatch(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SlotResult]
    def __init__(self, results: _Optional[_Iterable[_Union[SlotResult, _Mapping]]] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("session_id", "hash", "meta", "data")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    hash: bytes
    meta: bytes
    data: bytes
    def __init__(self, session_id: _Optional[str] = ..., hash: _Optional[bytes] = ..., meta: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored", "already_stored", "no_space")
    STORED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_STORED_FIELD_NUMBER: _ClassVar[int]
    NO_SPACE_FIELD_NUMBER: _ClassVar[int]
    stored: int
    already_stored: int
    no_space: int
    def __init__(self, stored: _Optional[int] = ..., already_stored: _Optional[int] = ..., no_space: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("session_id", "hashes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    hashes: bytes
    def __init__(self, session_id: _Optional[str] = ..., hashes: _Optional[bytes] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("hash", "data")
    HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    data: bytes
    def __init__(self, hash: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "query_tokens", "hit_tokens", "blocks_stored", "blocks_loaded", "blocks_evicted", "blocks_spilled", "blocks_promoted", "blocks_deduplicated", "bytes_in", "bytes_out", "checksum_failures", "used_blocks", "capacity_blocks", "used_bytes", "capacity_bytes", "blocks_dropped", "other", "layout", "oldest_block_age_s", "read_bytes_per_s")
    class OtherEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TIER_FIELD_NUMBER: _ClassVar[int]
    QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_LOADED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_EVICTED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SPILLED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PROMOTED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_DEDUPLICATED_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    OTHER_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    OLDEST_BLOCK_AGE_S_FIELD_NUMBER: _ClassVar[int]
    READ_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    tier: str
    query_tokens: int
    hit_tokens: int
    blocks_stored: int
    blocks_loaded: int
    blocks_evicted: int
    blocks_spilled: int
    blocks_promoted: int
    blocks_deduplicated: int
    bytes_in: int
    bytes_out: int
    checksum_failures: int
    used_blocks: int
    capacity_blocks: int
    used_bytes: int
    capacity_bytes: int
    blocks_dropped: int
    other: _containers.ScalarMap[str, int]
    layout: str
    oldest_block_age_s: float
    read_bytes_per_s: float
    def __init__(self, tier: _Optional[str] = ..., query_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., blocks_stored: _Optional[int] = ..., blocks_loaded: _Optional[int] = ..., blocks_evicted: _Optional[int] = ..., blocks_spilled: _Optional[int] = ..., blocks_promoted: _Optional[int] = ..., blocks_deduplicated: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., used_blocks: _Optional[int] = ..., capacity_blocks: _Optional[int] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., blocks_dropped: _Optional[int] = ..., other: _Optional[_Mapping[str, int]] = ..., layout: _Optional[str] = ..., oldest_block_age_s: _Optional[float] = ..., read_bytes_per_s: _Optional[float] = ...) -> None: ...

class LayoutStats(_message.Message):
    __slots__ = ("layout", "slot_bytes", "num_slots", "arena_path", "disk", "sessions", "reserved_slots", "acquired_slots", "quarantined_slots", "writing_behind", "held_slots", "holds_refused", "holds_expired", "holds_yielded", "holds_missed", "reserved_ahead_slots", "pinned_blocks", "pins_refused", "pins_missed")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    ARENA_PATH_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    ACQUIRED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    WRITING_BEHIND_FIELD_NUMBER: _ClassVar[int]
    HELD_SLOTS_FIELD_NUMBER: _ClassVar[int]
    HOLDS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    HOLDS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    HOLDS_YIELDED_FIELD_NUMBER: _ClassVar[int]
    HOLDS_MISSED_FIELD_NUMBER: _ClassVar[int]
    RESERVED_AHEAD_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PINS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    PINS_MISSED_FIELD_NUMBER: _ClassVar[int]
    layout: str
    slot_bytes: int
    num_slots: int
    arena_path: str
    disk: str
    sessions: int
    reserved_slots: int
    acquired_slots: int
    quarantined_slots: int
    writing_behind: int
    held_slots: int
    holds_refused: int
    holds_expired: int
    holds_yielded: int
    holds_missed: int
    reserved_ahead_slots: int
    pinned_blocks: int
    pins_refused: int
    pins_missed: int
    def __init__(self, layout: _Optional[str] = ..., slot_bytes: _Optional[int] = ..., num_slots: _Optional[int] = ..., arena_path: _Optional[str] = ..., disk: _Optional[str] = ..., sessions: _Optional[int] = ..., reserved_slots: _Optional[int] = ..., acquired_slots: _Optional[int] = ..., quarantined_slots: _Optional[int] = ..., writing_behind: _Optional[int] = ..., held_slots: _Optional[int] = ..., holds_refused: _Optional[int] = ..., holds_expired: _Optional[int] = ..., holds_yielded: _Optional[int] = ..., holds_missed: _Optional[int] = ..., reserved_ahead_slots: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., pins_refused: _Optional[int] = ..., pins_missed: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "sessions", "reserved_slots", "acquired_slots", "uptime_s", "events_dropped", "layouts", "quarantined_slots", "watchers", "reserved_ahead_slots", "layout_blocks")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    ACQUIRED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    EVENTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    WATCHERS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_AHEAD_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    sessions: int
    reserved_slots: int
    acquired_slots: int
    uptime_s: float
    events_dropped: int
    layouts: _containers.RepeatedCompositeFieldContainer[LayoutStats]
    quarantined_slots: int
    watchers: int
    reserved_ahead_slots: int
    layout_blocks: _containers.RepeatedCompositeFieldContainer[LayoutBlocks]
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., sessions: _Optional[int] = ..., reserved_slots: _Optional[int] = ..., acquired_slots: _Optional[int] = ..., uptime_s: _Optional[float] = ..., events_dropped: _Optional[int] = ..., layouts: _Optional[_Iterable[_Union[LayoutStats, _Mapping]]] = ..., quarantined_slots: _Optional[int] = ..., watchers: _Optional[int] = ..., reserved_ahead_slots: _Optional[int] = ..., layout_blocks: _Optional[_Iterable[_Union[LayoutBlocks, _Mapping]]] = ...) -> None: ...

class LayoutBlocks(_message.Message):
    __slots__ = ("layout", "open", "block_bytes", "block_tokens", "num_layers", "num_kv_heads", "head_size", "dtype", "description", "host_blocks", "disk_blocks", "disk", "remote", "remote_blocks_sent")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCKS_SENT_FIELD_NUMBER: _ClassVar[int]
    layout: str
    open: bool
    block_bytes: int
    block_tokens: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    description: str
    host_blocks: int
    disk_blocks: int
    disk: str
    remote: bool
    remote_blocks_sent: int
    def __init__(self, layout: _Optional[str] = ..., open: _Optional[bool] = ..., block_bytes: _Optional[int] = ..., block_tokens: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., dtype: _Optional[str] = ..., description: _Optional[str] = ..., host_blocks: _Optional[int] = ..., disk_blocks: _Optional[int] = ..., disk: _Optional[str] = ..., remote: _Optional[bool] = ..., remote_blocks_sent: _Optional[int] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("layout_signature", "replay")
    LAYOUT_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    layout_signature: bytes
    replay: bool
    def __init__(self, layout_signature: _Optional[bytes] = ..., replay: _Optional[bool] = ...) -> None: ...

class BlockEvent(_message.Message):
    __slots__ = ("kind", "tier", "hash", "meta", "layout_signature")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[BlockEvent.Kind]
        STORED: _ClassVar[BlockEvent.Kind]
        REMOVED: _ClassVar[BlockEvent.Kind]
    KIND_UNSPECIFIED: BlockEvent.Kind
    STORED: BlockEvent.Kind
    REMOVED: BlockEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    kind: BlockEvent.Kind
    tier: str
    hash: bytes
    meta: bytes
    layout_signature: bytes
    def __init__(self, kind: _Optional[_Union[BlockEvent.Kind, str]] = ..., tier: _Optional[str] = ..., hash: _Optional[bytes] = ..., meta: _Optional[bytes] = ..., layout_signature: _Optional[bytes] = ...) -> None: ...

class BlockEvents(_message.Message):
    __slots__ = ("events", "replay_done")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_DONE_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[BlockEvent]
    replay_done: bool
    def __init__(self, events: _Optional[_Iterable[_Union[BlockEvent, _Mapping]]] = ..., replay_done: _Optional[bool] = ...) -> None: ...
