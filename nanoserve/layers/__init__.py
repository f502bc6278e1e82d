"""Model building blocks; tensor parallelism lives in their weight loaders and collectives."""
