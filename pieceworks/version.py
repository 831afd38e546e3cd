"""The package version, below every other module so that writers of metadata (the quantizer's
hf_quant_config.json, the SmolLM2 cache stamp) can import it without importing the package's API."""

__version__ = "0.1.0"
