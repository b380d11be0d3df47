"""``DaemonClient``'s calls off the engine's load and store path: bytes through gRPC rather
than the arena (a client that cannot map it: another host, a test), pins, Stats, and the block
event stream (routers' announcements). ``DaemonClient.tools`` is one ``ToolCalls``, sharing
the client's session, breaker and failure handling, which it is handed explicitly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import grpc

from kvtier.connector.client.circuit import CircuitBreaker
from kvtier.connector.client.session import SessionKeeper
from kvtier.connector.client.wire import pack_hashes
from kvtier.proto import kvtier_pb2 as pb
from kvtier.proto import kvtier_pb2_grpc as pb_grpc
from kvtier.tiers.hashing import BlockHash


class ToolCalls:
    def __init__(
        self,
        stub: pb_grpc.KvTierStub,
        keeper: SessionKeeper,
        breaker: CircuitBreaker,
        usable: Callable[[bool], str | None],
        failed: Callable[..., None],
        *,
        metadata,
        layout_signature: bytes,
        timeout_s: float,
        block_bytes: int,
        load_gbps: float,
    ):
        """``usable(counts)`` is the session to call on (None: none, or the breaker is open);
        ``failed(method, error, session)`` counts a failed call and acts on it."""
        self._stub = stub
        self._keeper = keeper
        self.breaker = breaker
        self._usable = usable
        self._failed = failed
        self._metadata = metadata
        self.layout_signature = layout_signature
        self.timeout_s = timeout_s
        self.block_bytes = block_bytes
        self.load_gbps = load_gbps

    def put_blocks(
        self,
        hashes: Sequence[BlockHash],
        blocks: Sequence[bytes],
        metas: Sequence[bytes] | None = None,
    ) -> int:
        """Stores whole blocks sent as bytes; returns how many were newly stored."""
        session = self._usable(bool(hashes))
        if session is None:
            return 0
        if len(hashes) != len(blocks) or (metas is not None and len(metas) != len(hashes)):
            raise ValueError("hashes, blocks and metas must have the same length")

        def messages():
            for i, (h, data) in enumerate(zip(hashes, blocks, strict=True)):
                yield pb.PutRequest(
                    session_id=session if i == 0 else "",
                    hash=h,
                    meta=metas[i] if metas else b"",
                    data=bytes(data),
                )

        try:
            reply = self._stub.Put(
                messages(), timeout=self._deadline(len(hashes)), metadata=self._metadata
            )
        except grpc.RpcError as exc:
            self._failed("Put", exc, session)
            return 0
        return reply.stored

    def get_blocks(self, hashes: Sequence[BlockHash]) -> list[bytes]:
        """Copies of the held prefix of ``hashes``, as bytes."""
        session = self._usable(bool(hashes))
        if session is None:
            return []
        request = pb.GetRequest(session_id=session, hashes=pack_hashes(hashes))
        blocks: list[bytes] = []
        try:
            for reply in self._stub.Get(
                request, timeout=self._deadline(len(hashes)), metadata=self._metadata
            ):
                blocks.append(reply.data)
        except grpc.RpcError as exc:
            self._failed("Get", exc, session)
        return blocks

    def pin(self, hashes: Sequence[BlockHash], seconds: float) -> Future[tuple[int, int]]:
        """Asks the daemon to keep these blocks in its host tier for ``seconds``, within this
        session's pin budget, without waiting: the future gives (pinned, refused) once the
        daemon has answered ((0, 0) for what it could not be asked). It never raises."""
        result: Future[tuple[int, int]] = Future()
        session = self._usable(bool(hashes))
        if session is None or not hashes:
            result.set_result((0, 0))
            return result
        step = self._keeper.limits.max_hashes
        chunks = [hashes[i : i + step] for i in range(0, len(hashes), step)]
        answers: list[tuple[int, int]] = []
        lock = threading.Lock()

        def answered(call: grpc.Future) -> None:
            try:
                reply = call.result()
                answer = (reply.pinned, reply.refused)
            except (grpc.RpcError, grpc.FutureCancelledError) as exc:
                if isinstance(exc, grpc.RpcError):
                    self._failed("Pin", exc, session)
                answer = (0, 0)
            with lock:
                answers.append(answer)
                last = len(answers) == len(chunks)
            if last:
                result.set_result((sum(a[0] for a in answers), sum(a[1] for a in answers)))

        for chunk in chunks:
            request = pb.PinRequest(session_id=session, hashes=pack_hashes(chunk), seconds=seconds)
            call = self._stub.Pin.future(request, timeout=self.timeout_s, metadata=self._metadata)
            call.add_done_callback(answered)
        return result

    def stats(self) -> pb.StatsResponse | None:
        """The daemon's counters, or None if it cannot be reached."""
        try:
            return self._stub.Stats(
                pb.StatsRequest(), timeout=self.timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            self._failed("Stats", exc, None)
            return None

    def watch_events(self, replay: bool) -> grpc.Future | None:
        """The daemon's block events for this client's layout: an iterator of
        ``BlockEvents`` that also cancels (``cancel()``). With ``replay``, what the tiers hold
        now comes first, its last batch marked ``replay_done``. It has no deadline: it ends
        when the daemon does or it is cancelled, raising ``grpc.RpcError`` then. None when the
        daemon is not reachable now."""
        if self._keeper.session is None or not self.breaker.allow():
            return None
        request = pb.WatchRequest(layout_signature=self.layout_signature, replay=replay)
        return self._stub.WatchEvents(request, metadata=self._metadata)

    def _deadline(self, blocks: int) -> float:
        return self.timeout_s + blocks * self.block_bytes / (self.load_gbps * 1e9)
