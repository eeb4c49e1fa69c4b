"""What each part of a checkpoint holds and how it is written and read.

Model weights (safetensors or DCP), optimizer state, extra state, the Hugging Face bundle and its
offline consolidation.
"""
