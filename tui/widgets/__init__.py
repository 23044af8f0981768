"""The dashboard's own widgets."""
