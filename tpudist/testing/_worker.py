"""One rank of a RankPool: connects back to the pool and runs what it is sent."""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from datetime import timedelta
from multiprocessing.connection import Client


def _setup(sys_path: list[str], backend: str | None) -> None:
    for entry in sys_path:
        if entry not in sys.path:
            sys.path.append(entry)
    if backend is not None:
        import torch.distributed as dist

        dist.init_process_group(backend, timeout=timedelta(seconds=60))


def main() -> None:
    rank = int(os.environ["RANK"])
    conn = Client(("127.0.0.1", int(os.environ["TPUDIST_POOL_PORT"])),
                  authkey=bytes.fromhex(os.environ["TPUDIST_POOL_KEY"]))
    conn.send(rank)
    while True:
        payload = conn.recv_bytes()
        try:
            message = pickle.loads(payload)
            if message[0] == "exit":
                break
            if message[0] == "setup":
                result = _setup(*message[1:])
            else:
                fn, args, kwargs = message[1:]
                result = fn(*args, **kwargs)
            reply = pickle.dumps(("ok", result))  # plain pickle: tensors go by value, not shared memory
        except BaseException:  # noqa: BLE001 - the traceback goes back to the pool
            reply = pickle.dumps(("err", traceback.format_exc()))
        conn.send_bytes(reply)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        conn.close()


if __name__ == "__main__":
    main()
