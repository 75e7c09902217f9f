"""Engine replicas behind one router, on Ray Serve (`inflight serve --replicas N`). Only
`router`, `replica`, `ingress` and `launch` import Ray; `routing` is the rule itself, which the
simulator's fleet runs too."""
