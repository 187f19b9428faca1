"""Built-in tools and interactions, each a few lines over the protocols in turnrl.env."""
