"""Operations around conversions: hub publishing and sources, batch jobs, bundles."""
