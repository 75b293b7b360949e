"""What the tests compare against: a naive reference decoder, kept in the package as the oracle."""
