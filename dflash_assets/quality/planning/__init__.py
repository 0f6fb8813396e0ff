"""Which cap to run with: the cap plan from the observed lengths, a length probe's measurements and the window policy."""
