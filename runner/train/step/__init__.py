"""One optimizer step: the microbatches' forward and backward passes, what the loss is
divided by, and grad_accum=auto."""
