"""A loopback TCP proxy that a test can cut (connections dropped, new ones refused) and restore on the same port:
a network partition between one client and a server that stays up."""

from __future__ import annotations

import asyncio
import contextlib

from conftest import free_port


class TcpProxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.host = host
        self.target_port = target_port
        self.port = free_port()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._pipes: set[asyncio.Task[None]] = set()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._serve, self.host, self.port, reuse_address=True)
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)  # at once: a cut while the upstream connection opens must drop this one too
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.target_port)
        except OSError:
            self._writers.discard(writer)
            writer.close()
            return
        if writer not in self._writers:  # cut meanwhile
            up_writer.transport.abort()
            return
        self._writers.add(up_writer)
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(src, dst))
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        dst.close()
        self._writers.discard(dst)

    async def cut(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for task in list(self._pipes):
            task.cancel()
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()
        if server is not None:
            # The listening socket is closed already; wait_closed also waits for every accepted connection to
            # be gone (Python 3.11.5+), which the aborts above make quick — bounded, so that a transport still
            # flushing to a peer that stopped reading cannot hang a test (a CI run's partition test hung 300 s at a
            # place the dump did not show; a connection accepted just before a cut was one way to get there).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await server.wait_closed()

    async def restore(self) -> None:
        await self.start()

    async def close(self) -> None:
        await self.cut()
