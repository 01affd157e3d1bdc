"""Reading experts from disk: the safetensors index (shards), the store that reads an expert
straight into slot memory, checkpoint conversion, and every file write (files)."""
