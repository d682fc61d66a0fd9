"""The package's version, in a module of its own: `cost_store` keys records by it without importing the package."""

VERSION = "0.1.0"
