"""Step times measured on this machine's CPU, each against dense in the same run."""
