"""Block identity and payload format: pure functions and frozen value types."""
