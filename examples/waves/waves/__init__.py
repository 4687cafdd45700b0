"""A user's own project that runner trains: a small regression problem (recover the
amplitude and phase of a noisy sine wave), nothing of it built into runner."""
