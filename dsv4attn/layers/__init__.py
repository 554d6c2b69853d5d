"""The DeepSeek-V4 attention layer (all three kinds), its compressor, indexer and runner."""
