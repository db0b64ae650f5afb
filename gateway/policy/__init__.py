"""How long each step's draft is: the γ policies, the load cap that bounds γ by how busy the
target is and the cost priors it starts from, AUTO's floor against plain decoding, which
hosted draft serves a request, and the state every request's policy shares."""
