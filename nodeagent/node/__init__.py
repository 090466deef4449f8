"""One node's stack: the component state machine, the supervisor that hosts it (launch, stop, residue, policy,
ordering, redeploy, adoption), and the node's side of the seam (`nodeport`).
"""
