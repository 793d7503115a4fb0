"""Moving request state between the services: the packed region layout both derive, packing to and unpacking
from a cache pool, the Mooncake engine wrapper, and the decode-side arena with its region allocator."""
