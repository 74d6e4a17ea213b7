"""Tables and plots built from run directories only; training never draws."""
