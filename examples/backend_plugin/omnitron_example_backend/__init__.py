"""An out-of-tree omnitron backend (host CPU + gloo, one kernel of its own); see README.md beside it."""
