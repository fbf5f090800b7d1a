"""Small helpers with no ktconvert concepts: safe reads, TOML schema, extras, env, profile, progress, SVG report."""
