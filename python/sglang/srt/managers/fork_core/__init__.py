"""How the fork touches upstream (fork): the hook table, upstream accessors, the resource report."""
