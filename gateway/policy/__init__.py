"""How long each step's draft is: the γ policies, the load cap that bounds γ by how busy the
target is, the task priors, AUTO's floor against plain decoding, and which hosted draft
serves a request."""
