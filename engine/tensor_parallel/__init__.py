"""Tensor parallelism: rank 0's executor, the worker ranks, their step protocol and sharding.

group.py        rank 0: starts (or joins) the ranks, sends each step, watches the workers
worker.py       ranks 1..N-1: load a shard, run every step rank 0 sends
protocol.py     one step's inputs on the wire (gloo control group)
sharding.py     which heads and rows each rank holds
distributed.py  process groups, torchrun's environment, threads per rank
"""
