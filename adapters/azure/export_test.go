package azfence

// LineLen returns how many Acquire calls of a wait in name's line.
func LineLen(a *Acquirer, name string) int { return a.line.Len(name) }
