"""The router's view of the tiers: protocols, gRPC clients, replica pools and placement."""
