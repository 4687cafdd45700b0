"""`runner export`: a run's weights as safetensors (and a Hugging Face directory)."""
