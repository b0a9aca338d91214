"""What a scheduler holds (fork): the resource report, the top layer: it reads every concern, none imports it."""
