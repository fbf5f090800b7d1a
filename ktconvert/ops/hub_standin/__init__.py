"""A local stand-in for the HF Hub and ModelScope (ktconvert hub-server)."""
