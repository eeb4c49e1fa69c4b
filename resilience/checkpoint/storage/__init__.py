"""Durable bytes: fsync'd files and directories, manifests with digests, the LATEST/LOWEST_VAL pointers,
safetensors files and the DCP adapter; and object storage (``s3://``, ``msc://``): the small store
interface (object_store, s3_store, msc_store, stores), ObjectPath, and range reads of the files a
resume did not download (remote_files)."""
