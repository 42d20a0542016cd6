"""One file per strategy: data, tensor, expert and pipeline parallelism."""
