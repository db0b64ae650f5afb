"""The verifier service: hosts the target model and scores γ+1 positions in one forward."""
