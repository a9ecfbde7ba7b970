"""The launch wing: starting torchrun's agents on every node, the run's store and what the
launcher and the ranks say through it, watching and tearing down the processes."""
