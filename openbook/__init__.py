"""openbook: Retrieval-Augmented Generation served as microservices."""
