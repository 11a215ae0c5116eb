#!/usr/bin/env python3
"""NCCL baseline for the two-node simulation (bench/results/two_nodes_h200x2.md): two processes, one GPU
each, told they are different hosts exactly as tests/gpu/165-two-nodes-cuda.sh tells the daemons
(CUDA_VISIBLE_DEVICES, NCCL_HOSTID, NCCL_P2P_DISABLE/SHM_DISABLE/IB_DISABLE, NCCL_SOCKET_IFNAME=lo),
exchange the byte counts of the epd steps both ways at once with batched isend/irecv (what the daemon's
grouped ncclSend/ncclRecv does) and print the mean time per exchange.
Usage: python3 bench/net/nccl_p2p_baseline.py [iters]
"""
import multiprocessing as mp
import os
import socket
import sys
import time

SIZES = [
    ("LL dispatch rows, 128 tokens x 7168 BF16", 128 * 7168 * 2),
    ("LL combine partials, 128 tokens x 7168 float32", 128 * 7168 * 4),
    ("HT dispatch rows, 4096 tokens x 7168 BF16", 4096 * 7168 * 2),
]


def child(rank, port, iters, q):
    os.environ.update({"CUDA_VISIBLE_DEVICES": str(rank), "NCCL_HOSTID": f"node{rank}", "NCCL_P2P_DISABLE": "1",
                       "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo",
                       "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                       "NVSHMEM_DISABLE_NVLS": "1"})
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=torch.device("cuda:0"))
    peer = 1 - rank
    res = []
    for name, nbytes in SIZES:
        s = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
        r = torch.empty_like(s)

        def ex():
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, s, peer), dist.P2POp(dist.irecv, r, peer)]):
                w.wait()

        n = iters if nbytes < 16 << 20 else max(3, iters // 4)
        for _ in range(3):
            ex()
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            ex()
        torch.cuda.synchronize()
        us = (time.perf_counter() - t0) / n * 1e6
        res.append((name, nbytes, us))
    dist.destroy_process_group()
    if rank == 0:
        q.put(res)


def main():
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=child, args=(r, port, iters, q)) for r in range(2)]
    for p in ps:
        p.start()
    res = q.get(timeout=240)
    for p in ps:
        p.join(timeout=60)
    for name, nbytes, us in res:
        print(f"nccl-baseline: {name}: {nbytes} bytes each way, {us:.1f} us per exchange, "
              f"{nbytes / us / 1e3:.2f} GB/s per direction")


if __name__ == "__main__":
    main()
