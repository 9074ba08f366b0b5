"""Eval task families; importing a module registers its tasks in `mtrain.eval.registry.TASKS`.

niah (depth x length grid), ruler (13 tasks), pg19 (perplexity), infbench (InfiniteBench).
"""
