"""The demo: a byte-level GPT trained on the stdlib's source with the sharded optimizers.

Run it with `python -m vescale_optim.demo` (see `--help`), or call `train.train(cfg)`
on each rank of a process group (or in one process, with none).
"""
