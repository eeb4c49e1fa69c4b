"""Durable bytes on disk: fsync'd files and directories, manifests with digests, the LATEST/LOWEST_VAL pointers, safetensors files and the DCP adapter."""
