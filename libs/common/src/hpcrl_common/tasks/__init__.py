"""Task definitions shipped with hpcrl (TOML files next to this module)."""
