"""vaeopt's version, in a module that imports nothing: the cache keys its entries with it, and the CLI prints it,
without importing the package's decode stack."""

VERSION = "0.1.0"
