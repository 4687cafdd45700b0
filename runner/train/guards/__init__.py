"""What watches the training: the non-finite guard, loss spikes, and the faults tests inject."""
