"""What the tests share and are not tests themselves: stand-in servers, real services started on loopback,
project and data builders. Test modules import from here, never from one another."""
