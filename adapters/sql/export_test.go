package sqlfence

// LineLen returns how many Acquire calls of a wait in name's line.
func LineLen(a *Acquirer, name string) int { return a.line.Len(name) }

// LineHeadTrying reports whether the head of name's line is inside an
// attempt now.
func LineHeadTrying(a *Acquirer, name string) bool { return a.line.HeadStalled(name, 0) }
