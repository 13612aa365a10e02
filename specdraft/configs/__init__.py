"""Settings dataclasses, one module per area: typed, frozen, importing only dataclasses and ConfigError."""
