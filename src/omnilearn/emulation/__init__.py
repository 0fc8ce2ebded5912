"""emulation."""
