"""Model families built from omnitron.core.transformer."""
