"""Reading and writing model formats of other tools (Hugging Face Llama folders)."""
