"""OCI images: references, the registry client, safe layer unpack, the EROFS layer store and
pulls (one per reference at a time). docs/images.md describes the whole."""
