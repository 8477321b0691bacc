"""`dtlab predict`: step time, throughput and MFU of a strategy at any world size, before running.

events.py    one step of one rank as events (compute, issue, wait): the contract of the rest
trace.py     records those events from dtlab's own strategy wrappers under a fake process group
cluster.py   a cluster file: GPUs per node, peaks, links; price.py and roofline.py turn events
             into seconds
simulate.py  the events of the traced ranks on compute and communication streams -> one step

A command: may import every layer below the commands; never another command.
"""
