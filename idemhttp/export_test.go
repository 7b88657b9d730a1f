package idemhttp

// PendingAcks is Transport.pendingAcks, for the tests of package
// idemhttp_test only (this file is compiled only with them).
func PendingAcks(t *Transport) int { return t.pendingAcks() }
