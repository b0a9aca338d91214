"""How the fork touches upstream (fork): the hook and swap tables, upstream accessors, the knobs, decisions all ranks
take together. The bottom layer: it imports none of the fork's other packages."""
