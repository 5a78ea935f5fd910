"""Models fsdp8 ships or reads: the built-in Llama, and Hugging Face model directories."""
